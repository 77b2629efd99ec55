"""What the framework integrations share: which optimizers optimshift places, and the two moves they make."""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _mode, api
from .._devices import resolve
from .._dtensor import is_dtensor
from .._errors import warn
from .._offload import pending_of, record_of
from .._state import unwrap

__all__ = [
    "held",
    "hand_over",
    "placeable",
    "follow_params",
    "to_host",
    "reload_to",
    "Swap",
    "Patch",
    "bound_swaps",
    "streamed",
    "warn",
]

# What a replacement takes of the function it replaces: its name (logs and tracebacks read naturally), not its
# docstring or module.
NAMES_ONLY = ("__name__", "__qualname__")


def held(optimizer: Any) -> bool:
    """Whether optimshift holds this optimizer's state (offloaded or streamed): it stays optimshift's, whatever its
    state: a framework's own code would take it off the host and leave its record behind."""
    return record_of(unwrap(optimizer)) is not None or streamed(optimizer)  # (any object: placeable asks first)


def hand_over(optimizer: Any) -> None:
    """Complete a transfer optimshift left in flight before the framework's own code, which reads the state directly,
    takes this optimizer (whether or not the copies had finished: never a race, never a timing's answer)."""
    pending_of(unwrap(optimizer)).wait()


def placeable(optimizer: Any) -> bool:
    """Whether optimshift places this optimizer's state: one it :func:`held`, or a torch optimizer (or an object with
    ``param_groups`` and ``state``) whose state is one dict of ordinary tensors (no DTensor) per param of its groups,
    beside optimizer-wide entries (MADGRAD's ``k``); else the framework's own code is left in charge
    (:func:`hand_over`)."""
    if held(optimizer) or _fits(optimizer):
        return True
    hand_over(optimizer)
    return False


def _fits(optimizer: Any) -> bool:
    """Whether this optimizer's state is one optimshift places (:func:`placeable` without :func:`held`)."""
    groups = getattr(optimizer, "param_groups", None)
    state = getattr(optimizer, "state", None)
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return False
    in_groups = {id(p) for group in groups if isinstance(group, Mapping) for p in group.get("params", ())}
    for key, entry in state.items():
        if not isinstance(key, torch.Tensor):
            continue  # an optimizer-wide entry: where a fresh optimizer of the class keeps it
        if id(key) not in in_groups or not isinstance(entry, Mapping):
            return False
        if any(is_dtensor(v) for v in entry.values()):
            return False
    return True


def streamed(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the one a wrapper holds) is streamed: its state stays where streaming keeps it."""
    return _mode.mode_of(unwrap(optimizer)) is not None


def follow_params(optimizer: Any) -> None:
    """Place every state tensor where a fresh optimizer over the params, where they are now, would keep it
    (a streamed optimizer's state is left on the host: its step streams it)."""
    if not streamed(optimizer):
        api.move(optimizer)


def to_host(optimizer: Any) -> None:
    """Place every state tensor where a fresh optimizer with its params on the host would keep it (a streamed
    optimizer's state is on the host already)."""
    if not streamed(optimizer):
        api.move(optimizer, torch.device("cpu"))


def reload_to(optimizer: Any, device: Any, *, what: str, non_blocking: bool) -> None:
    """A framework's "load the optimizer state onto ``device``" (``what`` names it in an error): back where
    :func:`optimshift.offload` took it from when that is ``device``, else where a fresh optimizer there keeps it."""
    params = [p for g in optimizer.param_groups for p in g["params"] if isinstance(p, torch.Tensor)]
    target = resolve(device, what=what, tensors=params)
    record = record_of(unwrap(optimizer))  # (a wrapper's offload is its optimizer's)
    recorded = {d for d in record.devices.values() if d.type != "cpu"} if record is not None else set()
    if recorded == {target}:
        api.reload(optimizer, non_blocking=non_blocking)  # type: ignore[call-overload]
    else:
        api.reload(optimizer, target, non_blocking=non_blocking)  # type: ignore[call-overload]


# --- the one patching idiom ------------------------------------------------------------------------------


@dataclass
class Swap:
    """One attribute of a framework (a module function, a class method) replaced by optimshift's version."""

    owner: Any  # a module or a class
    name: str
    original: Any
    replacement: Any


def module_items(module: Any) -> list[tuple[str, Any]]:
    """A module's global names and values, read from its ``__dict__`` (no ``__getattr__``, no lazy imports)."""
    namespace = getattr(module, "__dict__", None) if isinstance(module, types.ModuleType) else None
    return list(namespace.items()) if isinstance(namespace, dict) else []


def bound_swaps(pairs: Iterable[tuple[Any, Any]], first: Sequence[Any], packages: Collection[str]) -> list[Swap]:
    """A :class:`Swap` for every binding, under any name, of an original of ``pairs`` in the modules ``first`` (the
    defining ones, first), then in every other loaded module of ``packages`` (a user's alias is theirs to keep)."""
    replacements = {id(original): (original, replacement) for original, replacement in pairs}
    rest = [m for n, m in list(sys.modules.items()) if n.split(".")[0] in packages and all(m is not f for f in first)]
    swaps = []
    for module in [*first, *rest]:
        for name, value in module_items(module):
            pair = replacements.get(id(value))
            if pair is not None and pair[0] is value:
                swaps.append(Swap(module, name, value, pair[1]))
    return swaps


class Patch:
    """:class:`Swap` s applied and undone together (every integration's ``patch()``/``unpatch()``): ``apply(plan)``
    makes all ``plan()`` returns (it may raise: nothing replaced), ``undo()`` restores each original unless someone
    patched over ours (``rebound``: also where a module imported a replacement by name meanwhile)."""

    def __init__(self, *, rebound: bool = False) -> None:
        self._lock = threading.RLock()
        self._swaps: list[Swap] = []
        self._rebound = rebound

    def applied(self) -> bool:
        """Whether the swaps are in effect (every integration's ``is_patched()``)."""
        with self._lock:
            return bool(self._swaps)

    @property
    def swaps(self) -> list[Swap]:
        """The swaps in effect (a copy; empty when not applied)."""
        with self._lock:
            return list(self._swaps)

    def names(self) -> list[str]:
        """``module.name`` (or ``module.Class.name``) of every attribute replaced, sorted (empty when not applied)."""

        def owner(s: Swap) -> str:
            if isinstance(s.owner, types.ModuleType):
                return s.owner.__name__
            return f"{s.owner.__module__}.{s.owner.__qualname__}"

        return sorted(f"{owner(s)}.{s.name}" for s in self.swaps)

    def apply(self, plan: Callable[[], list[Swap]]) -> None:
        with self._lock:
            if self._swaps:
                return
            # NOTE: each swap is recorded before it is made, and an error or a Ctrl-C between two undoes the
            # ones made (undo restores only an attribute that still holds our replacement): all or nothing.
            try:
                for swap in plan():
                    self._swaps.append(swap)
                    setattr(swap.owner, swap.name, swap.replacement)
            except BaseException:
                self.undo()
                raise

    def undo(self) -> None:
        """Restore the framework's own attributes (every integration's ``unpatch()``); a no-op when not applied."""
        with self._lock:
            if not self._swaps:
                return
            for swap in reversed(self._swaps):
                if swap.owner.__dict__.get(swap.name) is swap.replacement:  # someone else may have patched over us
                    setattr(swap.owner, swap.name, swap.original)
            if self._rebound:
                # Modules imported after apply() bound the replacement by name: give them the original back too.
                by_replacement = {id(s.replacement): s for s in self._swaps}
                for module in list(sys.modules.values()):
                    for name, value in module_items(module):
                        bound = by_replacement.get(id(value))
                        if bound is not None and bound.replacement is value:
                            setattr(module, name, bound.original)
            self._swaps.clear()


_patches: dict[str, Patch] = {}  # (by integration module: its Patch outlives an importlib.reload of the module)


def patch_of(module: str, *, rebound: bool = False) -> Patch:
    """The one :class:`Patch` of integration ``module``: an ``importlib.reload`` of it finds the one in effect
    (a new one would patch twice over and could not restore the originals)."""
    return _patches.setdefault(module, Patch(rebound=rebound))


def own(owner: Any, name: str, missing: str) -> Any:
    """``owner``'s own callable ``name`` (from its ``__dict__``): what a patch replaces; else RuntimeError(missing)."""
    found = vars(owner).get(name)
    if not callable(found):
        raise RuntimeError(missing)
    return found


def importable(package: str) -> bool:
    """Whether ``package`` can be imported here (found, not imported): a patch module patches on import only then."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False
