"""What optimshift knows about one optimizer: its :class:`Session`, in a weak-keyed table beside it (never on it:
a collected optimizer takes its session along; one that cannot be weakly referenced or hashed has none)."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class _Place:
    """A param's place in the groups: the param there now (weakly), or the place that took over for the same param.
    Every param replaced there shares it, so a rebind moves them all by its own params alone."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now: weakref.ref[torch.Tensor] | _Place | None = None

    def __call__(self) -> torch.Tensor | None:
        now = self.now
        while isinstance(now, _Place):
            now = now.now
        return None if now is None else now()


class Rebound:
    """Each param an optimizer's rebinds replaced -> its :class:`_Place` (``get``), both weakly: nothing is held for
    a param no longer alive, and no entry for one back in its own place (which can never be stale)."""

    def __init__(self) -> None:
        # by id, each with a weakref to its param (whose callback drops it: the param died) and its place
        self._old: dict[int, tuple[weakref.ref[torch.Tensor], _Place]] = {}  # an old param -> its place
        self._now: dict[int, tuple[weakref.ref[torch.Tensor], _Place]] = {}  # the param in a place now -> the place
        # (the one callback of every weakref: it holds the tables weakly, never the other way round)
        self._drop = functools.partial(_gone, weakref.ref(self))

    def __len__(self) -> int:
        return len(self._old)

    def get(self, old: Any) -> _Place | None:
        """``old``'s place (called: the param there now, or None once it is gone), None if no rebind replaced it."""
        entry = self._old.get(id(old))
        return entry[1] if entry is not None and entry[0]() is old else None

    def record(self, renamed: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One rebind's (old, new) params: the params each old one had replaced follow it to its new one."""
        old, now = self._old, self._now
        # (all first: a swap takes its own places back)
        left = [now.pop(id(p)) if id(p) in now else (self._ref(p), _Place()) for p, _ in renamed]
        for (p, q), (ref, place) in zip(renamed, left):
            if (earlier := now.get(id(q))) is not None:  # (q left a place meanwhile, not by this session's rebind)
                earlier[1].now = place
            place.now = q_ref = self._ref(q)
            now[id(q)] = (q_ref, place)
            old[id(p)] = (ref, place)
        for _, q in renamed:
            if (entry := old.get(id(q))) is not None and entry[1]() is q:
                del old[id(q)]

    def _ref(self, param: torch.Tensor) -> _KeyedRef:
        ref = _KeyedRef(param, self._drop)
        ref.key = id(param)
        return ref


class _KeyedRef(weakref.ref):  # type: ignore[type-arg]
    """A weakref to a param that knows the param's id (one callback for all: a partial each cost 0.25 us)."""

    __slots__ = ("key",)
    key: int


def _gone(rebound: weakref.ref[Rebound], ref: _KeyedRef) -> None:
    """A param ``rebound`` remembers died: its entries go (those under its id that still name it)."""
    if (me := rebound()) is not None:
        for table in (me._old, me._now):
            if (entry := table.get(ref.key)) is not None and entry[0] is ref:
                table.pop(ref.key, None)


@dataclass(eq=False)
class Session:
    """Everything optimshift remembers about one optimizer."""

    lock: threading.RLock = field(default_factory=threading.RLock)  # one operation at a time (re-entrant)
    record: Any = None  # _offload.Record while offloaded
    pending: Any = None  # _offload.PendingTransfer while a non-blocking transfer may be in flight
    guards: list[Any] = field(default_factory=list)  # handles of the pre-hooks that wait for ``pending``
    mode: weakref.ref[Any] | None = None  # its _mode.Mode (weak: the optimizer keeps its mode alive)
    # group tensors (tensor lr, betas) a move or an offload took to the host from an accelerator, by id: where they
    # came from (a move back puts them there again), and the tensor (its id names it only while it lives)
    group_sides: dict[int, tuple[torch.device, torch.Tensor]] = field(default_factory=dict)
    plans: dict[Hashable, list[Any]] = field(default_factory=dict)  # operation key -> its _plan_cache.Cached
    addresses: Any = None  # _addresses.Layout: its state's reserved ranges and slots, once it keeps addresses
    pooled: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # a ZeRO-1/2 optimizer's pool buffers, by kind
    offloaded_in: int = 0  # offloaded() blocks (any thread) inside the offload one of them made: the last out reloads
    # each param its rebinds replaced -> the param in its place now, while the old one lives (a wrapper over its
    # groups, Lookahead, keeps state keyed by it: the wrapper's rebind re-keys that state by this)
    rebound: Rebound = field(default_factory=Rebound)


_sessions: weakref.WeakKeyDictionary[Any, Session] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def rememberable(optimizer: Any, what: str) -> None:
    """TypeError, naming the operation ``what``, unless a session can be kept for ``optimizer``."""
    try:
        weakref.ref(optimizer)
        hash(optimizer)
    except TypeError:
        raise TypeError(
            f"{what} needs an optimizer it can remember weakly (hashable, weak-referenceable); "
            f"{type(optimizer).__name__} is not: pass the torch.optim.Optimizer it wraps"
        ) from None


def of(optimizer: Any) -> Session | None:
    """``optimizer``'s session if it has one (None also for an optimizer that cannot have one)."""
    return get(optimizer, make=False)


def get(optimizer: Any, *, make: bool = True) -> Session | None:
    """``optimizer``'s session, made on first use; None for an optimizer that cannot be weakly referenced."""
    try:
        with _lock:
            return _sessions.get(optimizer) or (_sessions.setdefault(optimizer, Session()) if make else None)
    except TypeError:
        return None
