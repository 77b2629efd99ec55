"""What optimshift knows about one optimizer: its :class:`Session`, in a weak-keyed table beside it (never on it:
a collected optimizer takes its session along; one that cannot be weakly referenced or hashed has none)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary


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
    # each param its rebinds replaced -> a weakref to the param in its place now, while the old one lives (a wrapper
    # over its groups, Lookahead, keeps state keyed by it: the wrapper's rebind re-keys that state by this); a
    # WeakIdKeyDictionary (a tensor key is compared by identity), untyped
    rebound: Any = field(default_factory=WeakIdKeyDictionary)


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
